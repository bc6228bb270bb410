"""The client-facing coordinator: sessions, the round loop, batching and the speculation policy."""
