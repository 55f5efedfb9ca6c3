"""Where each state rests and each computation runs: the shard layout, the placement, the tiers and their budgets, host<->device copies, the estimate."""
