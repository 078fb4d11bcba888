"""The reference benchmark suite: cupymoe on this GPU against its roofline and the torch peer.

Run ``python -m cupymoe.bench`` (``--help`` lists the options). For every case of ``cases.json``
(shipped with the package) the inputs are drawn in the order the file documents, the output is
checked against a float32 reference (relative L2 error below 1e-2), and then eager calls and
CUDA-graph replays are timed: before each rep the L2 cache is flushed by writing 256 MiB and the
device is synchronised, CUDA events bracket one call, and the median over the reps (after a
warm-up) is reported. The speed of light (SOL) of a case comes from two ceilings measured in the
same run: streaming-read bandwidth and the bf16 matmul rate. When torch is importable, the torch
``grouped_mm`` pipeline runs on the same inputs as a peer (``--weights fp8``: torch ``scaled_mm``
per expert with the block scales, eager only). The suite prints one table and writes
``suite-<device>.json`` and ``suite-<device>.png``.

The library never imports this package. :mod:`.cases` needs only NumPy, so tests reuse it.
"""
