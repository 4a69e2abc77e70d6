"""Small real plugin modules that tests load through (monkeypatched) entry-point discovery."""
