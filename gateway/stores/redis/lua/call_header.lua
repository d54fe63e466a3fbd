-- Every call's header (prelude.lua declares the variables). ARGV[1]: the mode, one letter,
-- then the call's number, which the reply echoes last (the client checks each reply is its own
-- call's, so no reply can ever be taken for another call's). ARGV[2]: now in microseconds; ''
-- reads Redis TIME, the one clock all replicas share.
mode = string.sub(ARGV[1], 1, 1)
call_id = tonumber(string.sub(ARGV[1], 2)) or 0
now_us = tonumber(ARGV[2])
if not now_us then
  local t = redis.call('TIME')
  now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
