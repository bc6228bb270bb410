"""The maths of speculative decoding: sampling, verification, counter-based randomness, proposals, n-grams."""
