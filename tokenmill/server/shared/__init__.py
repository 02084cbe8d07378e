"""What the API route packages share, belonging to no one API: request-body bases
(:mod:`.request_body`), request fields -> SamplingParams (:mod:`.params`), tools offered to the chat
template (:mod:`.tools`), tool calls parsed from output (:mod:`.tool_parser`) and forced
(:mod:`.tool_constraint`), message content as text (:mod:`.content_text`), and the engine requests
behind one API call (:mod:`.generation`)."""
