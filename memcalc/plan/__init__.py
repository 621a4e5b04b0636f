"""Stage 4, planning: which GPU, how many, with which techniques (closed-form fits of the
simulated step searched over the option grid, every printed answer confirmed by a direct
estimate)."""
