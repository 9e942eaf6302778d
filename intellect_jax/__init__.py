"""intellect_jax: decentralized, fault-tolerant DiLoCo training of Llama-3 models in JAX/Flax.

The packages, each a role (``tests/test_layout.py`` checks the import graph: no cycles, nothing
imports ``testing``, and neither ``coordinator`` nor ``net`` imports the node):

- entry points, at the top: ``train``, ``launch``, ``export``, ``eval``, ``memory``, ``plot``
  (``python -m intellect_jax.<name>``), and ``python -m intellect_jax.coordinator``;
  ``config`` is the run's typed config, ``cli`` their shared error handling;
- :mod:`~intellect_jax.diloco`: a node (its outer loop, state, guard, device path, multi-host
  node, checkpoints, state transfer);
- :mod:`~intellect_jax.coordinator`: membership, journal and the service behind its socket
  server, and the client a node talks to it with;
- :mod:`~intellect_jax.net`: authenticated sockets and the int8 ring all-reduce;
- :mod:`~intellect_jax.trainer`, :mod:`~intellect_jax.model`, :mod:`~intellect_jax.data`,
  :mod:`~intellect_jax.kernels`: one node's inner training;
- :mod:`~intellect_jax.testing`: the seeded simulation, in-process fakes and fault injection;
  it ships (``python -m intellect_jax.testing.chaos``, ``python -m intellect_jax.testing.sim``),
  but nothing else imports it.
"""

__version__ = "0.1.0"
