"""The benchmark's chat prompt and the natural-language continuation fed one token per step.

Written for this benchmark (plain prose, no source). The prompt is cut to the wanted token
count by ``benchmarks/bench.py``; the continuation gives at least 128 tokens.
"""

INSTRUCTION = "Read the keeper's log below, then continue it in the same voice for another day.\n\n"

PASSAGE = """\
Monday. The wind came round to the north-east before dawn and the glass fell two tenths in an hour.
I trimmed the wicks at four, wound the clockwork at five and climbed down to the gallery to scrape the
salt from the lantern panes, which takes longer every winter because my hands no longer close as they
did. The supply boat is a week late. We have flour for nine days, paraffin for thirty, tea for perhaps
twelve if Martin stops brewing it twice in the same pot and calling the second cup fresh.

Tuesday. A grey morning with a long swell from the west that broke white over the lower landing. Martin
says the swell means weather far out in the ocean and that we shall have it here by Thursday. He learned
that from his father, who kept the light on the point for thirty-one years and never once, he claims,
let it go dark. I have heard the story of the night the clockwork jammed and his father turned the lens
by hand until morning perhaps forty times now, and each time the night grows longer and the sea higher.

In the afternoon I walked the rocks at low water and found a green bottle wedged between two stones,
its neck stopped with wax. There was paper inside, rolled tight and tied with a thread. I have not opened
it. Martin thinks I should break the glass at once; I would rather wait for a dry table and good light,
because paper that has been at sea a long time tears like wet bread. It sits on the shelf above the
stove beside the barometer, and we both look at it more often than at the barometer.

Wednesday. Fog from first light, thick enough that the horn ran for eleven hours and the engine needed
oil twice. Through the afternoon we heard a vessel's own horn to the south, answering ours, moving slowly
east and then fading. No sight of her. In the evening the fog lifted all at once, as it does here, and
the whole bay lay flat and pink under a clean sky, with the first stars over the headland. Martin cooked
the last of the salted fish with onions, and afterwards, at my asking, he held the lamp while I cut the
wax from the bottle with a warm knife and slid the paper out onto a cloth.

The message was written in pencil in a careful hand, in English, and dated nineteen years ago. It gave a
name, a village on the far side of the water, and a few lines addressed to whoever should find it. The
writer was a girl of twelve. She said that her father fished from a small blue boat and that she was
throwing the bottle from the end of the harbour wall so that someone far away would know she had lived
there and liked the sound of the sea at night. She asked the finder to write back. There was an address.

Thursday. The weather Martin promised arrived at noon."""

CONTINUATION = """\
By two the rain came sideways and the spray reached the lantern gallery, which it has not done since the
storm of the autumn before last. We lit early. I sat at the table between watches and wrote a letter to
the address in the bottle, though I do not know whether the village still stands or whether anyone there
remembers a girl who threw a bottle from the harbour wall. I told her where the bottle came ashore, on
which rocks and at what state of the tide, and that the paper had kept dry all those years under its
wax. I told her about the light, the clockwork and the horn, and about Martin, who read the letter over
my shoulder and asked me to add that the fish he cooked was excellent. The boat, when it comes, will take
the letter to the mainland, and from there it will go by rail and by road, and perhaps by another boat,
to a place I have only seen as a name on a chart. I sealed it and set it on the shelf where the bottle
stood. The wind is still rising. Martin is asleep. The lamp turns, and every ten seconds its beam passes
the window and the room goes white, then dark, then white again."""
