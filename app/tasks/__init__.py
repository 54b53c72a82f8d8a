"""Celery tasks. Each is thin: it loads ids and calls plain functions elsewhere.

Task names are explicit (`<queue>.<verb>`) so moving a function never orphans
messages already queued; routes in app/celery.py key on the prefix.
"""
