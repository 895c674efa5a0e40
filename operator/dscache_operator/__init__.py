"""dscache operator: DatasetCache controller and admission webhook (kopf)."""
