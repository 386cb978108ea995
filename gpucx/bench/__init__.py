"""Benchmark engine behind ``gpucx bench``.

* :mod:`.runner` — options, planning and the client side (``run_bench``);
* :mod:`.suites` — one class per test (``tag_lat``, ``tag_bw``, ``am_*``,
  ``stream_bw``, ``put_*``, ``get_bw``, ``fadd_lat``, ``array_bw``);
* :mod:`.session` — the connected pair and its control messages;
* :mod:`.peer` — the serving side (child process or ``--server``);
* :mod:`.perftest` — running and parsing ``ucx_perftest``;
* :mod:`.report` — table, JSON, plot, progress bar;
* :mod:`.sizes`, :mod:`.memory` — argument parsing and buffers;
* :mod:`.errors` — :class:`~.errors.BenchSetupError`.

``gpucx info`` lives in :mod:`gpucx.info` (``gpucx.bench.info`` is an alias).

The timing loops of ``tag_lat``, ``tag_bw``, ``put_bw`` and ``get_bw`` are C
(``gpucx/_csrc/bench.c``).
"""
