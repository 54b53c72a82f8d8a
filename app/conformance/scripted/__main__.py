"""`python -m app.conformance.scripted`: serve the scripted engine (see `server.main`)."""
from app.conformance.scripted.server import main

main()
