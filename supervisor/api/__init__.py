"""HTTP routes: parse, validate, ask the scheduler, answer errors in each API's own format."""
