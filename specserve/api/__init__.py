"""What the SDK and the servers share, without torch: the exception hierarchy, status codes, request parameters,
generation statistics."""
