"""Plumbing every role shares: the gRPC server shell, interceptors, settings, logs, metrics, the Redis store."""
