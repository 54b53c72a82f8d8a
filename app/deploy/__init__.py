"""Deployment to Kubernetes: the deploy spec (`spec`), the manifests it renders (`render`) and
the autoscaling query over the stage leases (`scaler`).  Used by `turnstile deploy render`."""
