"""The prompt lists shared by the training scripts and the benchmark, with their train / held-out split."""
