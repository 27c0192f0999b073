"""Training: the loop every rank runs, one optimizer step, mixed precision, the objective,
the schedule of batch and learning rate, the underflow watch and held-out loss."""
