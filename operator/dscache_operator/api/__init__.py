"""The DatasetCache API (dscache.io/v1alpha1): the pydantic models that are the CRD, and its generator.

May import: ``dscache_contract`` only. Everything else in the operator imports this room.
"""
