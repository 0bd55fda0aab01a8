"""What one training run keeps besides its components: the settings of the ``trainer``, ``logging`` and
``checkpoint`` sections (:mod:`.config`), the metric sinks and console line (:mod:`.metrics`), the plots of a
run's ``metrics.jsonl`` (:mod:`.plots`) and the stop on a signal (:mod:`.preemption`)."""
