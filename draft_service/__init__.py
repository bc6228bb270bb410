"""The draft tier: proposers (small model, n-gram) behind the DraftService gRPC API."""
