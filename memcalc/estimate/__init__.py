"""Stage 3, the estimate: one step simulated with the right layer strategy (``step``), its
peak, the phase and moment that set it, what is alive then, and the memory a GPU must have
(``peak``)."""
