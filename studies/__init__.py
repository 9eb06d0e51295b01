"""Studies over the training runtime: the performance model, scaling studies, benchmarks
and the layout-equivalence verifier. They import ``engine``, ``layers`` and
``parallel_state``; nothing in those packages imports them back."""
