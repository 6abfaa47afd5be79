"""Divergence → cause: which stage, which change, which piece of hardware made an output deviate.

``population`` finds deviating requests, their baselines and first divergent stages in SQL, and the
contrast that weighs attribute differences; ``rollouts`` finds settings that moved fleet-wide, whose
moments split the baselines into epochs; ``detectors`` are the plug-ins that propose causes
(attribute contrast, hardware signals from ``hardware``, rollouts, nondeterminism), ranked by
``causes``; ``explain`` and ``divergences`` are the two commands built on them.
"""
