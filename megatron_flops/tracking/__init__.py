"""Tracking (torch): each micro-batch observed and reduced to statistics with no host sync,
ownership across pipeline stages, the one fixed-shape all-reduce per step, and its
pricing into a StepResult."""
