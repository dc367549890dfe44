"""The patch options: the config (each option declared once), their command-line flags, the scale laws, argument checks."""
