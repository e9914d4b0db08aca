-- Hold an HTTP request while backend <be> has no usable server, at most <max_ms>.
-- core.msleep() yields to HAProxy, so the sleep does not count toward
-- tune.lua.session-timeout (only pure Lua CPU time does).
core.register_action("wait_for_backend", { "http-req" }, function(txn, be, max_ms)
    local limit, step, waited = tonumber(max_ms) or 60000, 250, 0
    while txn.f:nbsrv(be) == 0 and waited < limit do
        core.msleep(step)
        waited = waited + step
    end
    txn:set_var("txn.held_ms", waited)
end, 2)
