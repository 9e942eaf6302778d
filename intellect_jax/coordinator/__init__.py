"""intellect_jax.coordinator: who is in the run, and its one history.

- :mod:`.protocol`: the protocol version, the config, the errors and the messages a node gets;
- :mod:`.schema`: the strict wire schemas every request (and every reply a client reads) is
  parsed against;
- :mod:`.membership`: the membership's state machine (registration, heartbeats, barriers and
  epochs, evictions, completion) over the node table of :mod:`.roster`, with its rules beside
  it: :mod:`.admission` (refusals, joiners' donors), :mod:`.history` (hash agreement, rollbacks,
  the wait for lost state), :mod:`.policing` (sit-outs, strikes, false accusations);
- :mod:`.journal`: the run's record on disk (one hash per outer step), reloaded on restart;
- :mod:`.service`: membership + journal + timeouts behind ``handle(request, identity=...)``;
- :mod:`.server`: the socket server over the service; ``python -m intellect_jax.coordinator``
  runs it (``__main__``);
- :mod:`.client` and :mod:`.wire`: what a node uses to talk to a coordinator;
- :mod:`.clock`: time and threads behind one object, so the simulation can run this very code
  in virtual time.

It imports nothing of the node, the trainer or the model. See docs/coordinator.md.
"""
