"""Tools shared by the parser tests."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "parameters": {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "flag": {"type": "boolean"},
                "options": {"type": "object"},
                "items": {"type": "array"},
                "nothing": {"type": "null"},
                "text": {"type": "string"},
                "maybe": {"type": ["integer", "null"]},
                "either": {"anyOf": [{"type": "boolean"}, {"type": "string"}]},
            },
        },
    },
}

NO_ARGS = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

TOOLS = [WEATHER, TYPED, NO_ARGS]
