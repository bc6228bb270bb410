"""The target tier: batched verification and commit behind the TargetService gRPC API."""
