"""One-off experiments and their reports, beside the package and not installed with it.

Each measured something once, on one machine, and docs/benchmarks keeps what it wrote; ``python -m benchmarks
NAME ...`` runs one again from a checkout (:mod:`benchmarks.cli`). The benchmarks a user runs are
``specserve bench`` (:mod:`specserve.bench`).
"""
