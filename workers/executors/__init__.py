"""The executors the engine drives: one rank in process, or one Ray actor per TP rank."""
