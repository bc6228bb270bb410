"""Speculation: where each round's proposal comes from (a session's sources), how long it is (the policy), and what
the coordinator learns from each verdict."""
