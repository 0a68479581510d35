"""The full-set CI recipe (``examples/ci/build-full.yml``) against the builder it drives.

GitHub Actions cannot run here; what can drift is checked instead: the workflow is valid YAML
with the jobs docs/builder.md describes, its matrix deals exactly the shards its build command
names, and every ``python -m builder`` command in it is one the builder's parser accepts.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from builder.__main__ import parser

yaml = pytest.importorskip("yaml", reason="reading the workflow needs PyYAML (installed with ray)")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "ci" / "build-full.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def _runs(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def _builder_commands(job: dict, shard: int) -> list[list[str]]:
    commands = []
    for run in _runs(job):
        for line in run.splitlines():
            line = line.replace("${{ matrix.shard }}", str(shard))
            if line.startswith("python -m builder "):
                assert "${{" not in line, f"an expression the test does not know: {line}"
                commands.append(shlex.split(line)[3:])
    return commands


def test_the_recipe_builds_shards_then_merges_verifies_packs_and_makes_wheels(workflow: dict) -> None:
    assert list(workflow["jobs"]) == ["shard", "merge"] and workflow["jobs"]["merge"]["needs"] == "shard"
    shard_commands = _builder_commands(workflow["jobs"]["shard"], 1)
    assert [c[0] for c in shard_commands] == ["build"]
    merge_commands = _builder_commands(workflow["jobs"]["merge"], 1)
    assert [c[:2] if c[0] == "wheel" else c[:1] for c in merge_commands] == [
        ["merge"], ["verify"], ["pack"], ["wheel", "images"]]


def test_the_matrix_deals_exactly_the_shards_the_build_command_names(workflow: dict) -> None:
    job = workflow["jobs"]["shard"]
    shards = job["strategy"]["matrix"]["shard"]
    build = _builder_commands(job, 1)[0]
    count = int(re.fullmatch(r"1/(\d+)", build[build.index("--shard") + 1]).group(1))
    assert shards == list(range(1, count + 1))
    assert job["name"] == f"shard ${{{{ matrix.shard }}}}/{count}"
    assert build[build.index("--set") + 1] == "full" and "--cache" in build


def test_every_builder_command_in_the_recipe_parses(workflow: dict) -> None:
    for name, job in workflow["jobs"].items():
        for argv in _builder_commands(job, 16):
            args = parser().parse_args(argv)  # argparse exits on an unknown option
            assert args.command == argv[0], (name, argv)
