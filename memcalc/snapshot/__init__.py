"""PyTorch CUDA memory snapshots in and out: the format (:mod:`memcalc.snapshot.format`), the estimate
written as one (:mod:`memcalc.snapshot.export`) and a snapshot held against the estimate
(:mod:`memcalc.snapshot.compare`)."""
