"""Investigation scripts, not product commands: see README.md here."""
