"""intellect_jax.diloco: one DiLoCo node.

- :mod:`.loop`: the outer loop (:class:`~.loop.NodeLoop`): rounds of H inner steps, the
  pseudo-gradient's check, the ring all-reduce, the Nesterov outer step, joins and serving;
  :mod:`.parts`: what it is handed (settings, the protocols of its collaborators);
  :mod:`.overlap`: its rounds of inner steps, synchronous or overlapped;
- :mod:`.state`: :class:`~.state.DilocoState`, the one pytree a node's outer state is, its hash;
- :mod:`.guard`: the poison guard (a node's own check and the check of each average);
- :mod:`.inner` and :mod:`.device_pg`: the trainer as the loop's inner part, and the
  pseudo-gradient made and int8-encoded on the devices;
- :mod:`.multihost`: one node over several processes (a lead and followers);
- :mod:`.store` and :mod:`.transfer`: checkpoints, and a live state sent to a joiner;
- :mod:`.node`: a node put together from the run's config (``python -m intellect_jax.train``);
- :mod:`.config`: the ``[diloco]`` config section.
"""
