"""Stage 0, the foundation every stage reads: specs (what the user asks for), dtypes, units
(bytes, GiB = 2**30) and the user-error type. Imports nothing else of memcalc."""
