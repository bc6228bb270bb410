"""The launcher: the ``specserve`` command, the local stack, the demo, a private Redis."""
