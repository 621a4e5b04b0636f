"""Stage 2b, torch.compile: the forward graph recorded from the engine's walk (``graph``),
AOTAutograd's min-cut partitioner re-implemented (``partitioner``), its answer in bytes per
layer (``compiled``) and the compiled layers on the timeline (``backward``)."""
