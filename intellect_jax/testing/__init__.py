"""intellect_jax.testing: the test harness, shipped because its commands are user commands.

- :mod:`.sim` (``python -m intellect_jax.testing.sim``): the seeded fault simulation, whole
  runs of in-process nodes against the real coordinator code in virtual time (:mod:`.clock`):
  :mod:`.sim_plan` (parameters and the seeded schedule), :mod:`.sim_world` (the processes'
  shared state and fault points), :mod:`.sim_parts` (the stand-ins), :mod:`.sim_driver` (the
  run), :mod:`.sim_checks` (the invariants);
- :mod:`.chaos` (``python -m intellect_jax.testing.chaos``): seeded fault schedules against
  real processes started by the launcher;
- fakes: :mod:`.local` (numpy nodes and in-process runs), :mod:`.local_ring` (the ring's exact
  arithmetic in process), :mod:`.local_coordinator` (a coordinator that can be crashed);
- :mod:`.faults`: ring ranks as processes that kill, stop or garble themselves mid-reduction.

No product module imports this package (``tests/test_layout.py``). See docs/testing.md.
"""
