"""The draft tier: proposers (small model, n-gram) behind the DraftService gRPC API.

Modules:

* :mod:`draft_service.proposers`: the :class:`~draft_service.proposers.Proposer`
  interface, :class:`~draft_service.proposers.ModelProposer` (the draft model,
  KV cache per session) and :class:`~draft_service.proposers.NgramProposer`
  (prompt lookup, for coordinators older than the coordinator-side lookup), and the pure
  helper ``draft_distribution``.
* :mod:`draft_service.history`: what this replica knows of each session's
  committed tokens (``start_position`` protocol, FAILED_PRECONDITION to resync).
* :mod:`draft_service.messages`: ``ProposeCall.from_pb`` (request checks) and
  ``ProposeResult.to_pb``.
* :mod:`draft_service.engine`: ``DraftEngine``, one Propose / Release as domain calls on its model thread.
* :mod:`draft_service.servicer`: the thin gRPC servicer.
* :mod:`draft_service.server`: ``build_draft`` / ``start_draft(settings, model=None) -> DraftApp`` /
  ``serve(settings)``.
"""
