"""What the tests share and are not tests themselves: a loopback HTTP server with scripted faults
(``httpfaults``), the Triton-interpreter runner (``interpreter``), and the compute-sanitizer
scripts the lead runs on a GPU (``memcheck_attention``, ``memcheck_decode``)."""
