"""The engine: schedule -> execute -> update -> outputs, its asyncio loop, output processing and metrics glue."""
