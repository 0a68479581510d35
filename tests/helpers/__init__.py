"""What the tests share and are not tests themselves: a loopback HTTP server with scripted faults
(``httpfaults``), the Triton-interpreter runner (``interpreter``), what the fake driver libraries
share (``fake_driver``: its C header and the Python side), SASS opcode counts of a cubin
(``sass``), and the compute-sanitizer scripts the lead runs on a GPU (``memcheck_attention``,
``memcheck_decode``)."""
