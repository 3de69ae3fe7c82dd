"""Executor side of a run: :mod:`.trainer` (TensorFlow) and :mod:`.round` (the round logic).

Imports no pyspark; the engine's task functions pass Spark's task context in.
"""
