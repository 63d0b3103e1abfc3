"""The InferencePool API (pydantic models) and the CRD generated from them. Pure: no I/O."""
