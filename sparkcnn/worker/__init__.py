"""Executor side of a run: :mod:`.task` (how every task starts), :mod:`.round` and :mod:`.stream`
(the jobs and the stream transports' task bodies), :mod:`.trainer` (TensorFlow) and :mod:`.chaos`
(fault injection).

Imports no pyspark; the engine's task functions pass Spark's task context in.
"""
