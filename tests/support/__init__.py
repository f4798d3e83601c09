"""What only the tests use: hand-built sequences and groups, and the step each process of a
torchrun launch takes. What tests and benchmarks share is in benchmarks/support/."""
