"""phasewise's CPU backend, behind one door.

* ``capabilities``: the CPU (flags, ISA families, cores), read once;
* ``plan``: which kernel runs each projection at each row count, from a pinned plan file, the
  stored plan ``phasewise tune`` measured, or a rule from the CPU's flags (never timed at an
  engine's start);
* ``backend``: ``prepare_cpu_backend``, the one call made from outside
  (``phasewise.model.prepare``, as a model is loaded): the ops, the plan and its
  description; ``release_freed_heap``, which hands the set-up's transient copies back;
* ``tune``: ``phasewise tune``, the measurement behind a stored plan;
* ``kernels`` (the ctypes ABI, building and loading ``csrc/``), ``linear`` (the linear
  methods and their dispatch), ``ops`` (``CpuKernelOps``), ``quant`` (weight-only int8).

Importing the package imports nothing else (the CLI reads plan files without torch).
"""
