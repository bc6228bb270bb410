"""The draft tier: the draft model's proposer behind the DraftService gRPC API.

Modules:

* :mod:`specserve.draft.proposers`: the :class:`~specserve.draft.proposers.Proposer`
  interface, :class:`~specserve.draft.proposers.ModelProposer` (the draft model,
  KV cache per session), and the pure helper ``draft_distribution``. The n-gram
  proposer runs in the coordinator (``specserve.coordinator.speculation.sources.ngram``).
* :mod:`specserve.draft.history`: what this replica knows of each session's
  committed tokens (``start_position`` protocol, FAILED_PRECONDITION to resync).
* :mod:`specserve.draft.messages`: the engine's calls and results (``ProposeCall``, ``ProposeResult``),
  no wire.
* :mod:`specserve.draft.engine`: ``DraftEngine``, one Propose / Release as domain calls on its model thread.
* :mod:`specserve.draft.servicer`: the thin gRPC servicer, the draft's edge with the wire: ``call_from_pb``
  (request checks) and ``proposal_pb``.
* :mod:`specserve.draft.server`: ``build_draft`` / ``start_draft(settings, model=None) -> DraftApp`` /
  ``serve(settings)``.
"""
