"""What the user asks for: the config schema, the DeepSpeed translation and its "auto" values, units, learning-rate schedules."""
