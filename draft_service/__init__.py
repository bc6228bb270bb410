"""The draft tier: the draft model's proposer behind the DraftService gRPC API.

Modules:

* :mod:`draft_service.proposers`: the :class:`~draft_service.proposers.Proposer`
  interface, :class:`~draft_service.proposers.ModelProposer` (the draft model,
  KV cache per session), and the pure helper ``draft_distribution``. The n-gram
  proposer runs in the coordinator (``coordinator.local_proposers``).
* :mod:`draft_service.history`: what this replica knows of each session's
  committed tokens (``start_position`` protocol, FAILED_PRECONDITION to resync).
* :mod:`draft_service.messages`: ``ProposeCall.from_pb`` (request checks) and
  ``ProposeResult.to_pb``.
* :mod:`draft_service.engine`: ``DraftEngine``, one Propose / Release as domain calls on its model thread.
* :mod:`draft_service.servicer`: the thin gRPC servicer.
* :mod:`draft_service.server`: ``build_draft`` / ``start_draft(settings, model=None) -> DraftApp`` /
  ``serve(settings)``.
"""
