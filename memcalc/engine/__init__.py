"""Stage 2, the engine: the step as a timeline of allocations. Parameters (``params``,
``weights``), what each op allocates and saves (``ops``), the decoder walk (``forward``), the
layer strategies (``strategy``, ``checkpoint``), sharding, optimizers and the allocator/autograd
simulator (``sim``, ``allocator``), put together by ``timeline``. Never imports inputs,
compile, estimate, plan or render."""
