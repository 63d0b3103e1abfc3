"""The operator at run time: the reconcile orchestration and the kopf handlers."""
