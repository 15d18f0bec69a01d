"""A step-time simulator for data-parallel training (see `schedule` for the model)."""
